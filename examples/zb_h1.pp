# ZB-H1: 1F1B's memory with a third of its bubble.
# Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), its handcrafted
# schedules, Figure 3 (top):
# B split from W; F of stage s at s, B at 3d-2-2s, W at 3d-1+s, period 3.
# Works for every d >= 1 and m >= d.
schedule zb_h1 {
    param d = 4
    param m = 2 * d
    require m >= d, "ZB-H1's peak and bubble hold for m >= d microbatches"
    place parallel
    backward split
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d - 1 + s
    }
    # the paper: peak p·M_B; worker i (from 1) holds (p-i+1)·M_B + (i-1)·M_W
    expect peak_memory <= d * M_B
    expect peak_memory[0] == d * M_B
    expect peak_memory[d - 1] == M_B + (d - 1) * M_W
    # Table 1: bubble (p-1)(T_F + T_B - T_W) per device
    expect bubble == ((d - 1) * (T_F + T_B - T_W)
                      / (m * (T_F + T_B + T_W) + (d - 1) * (T_F + T_B - T_W)))
    expect makespan == 3*m + d - 1
    # controllable-memory paper: every stage lives 3d (F to W), so holds ⌈3d/3⌉ = d microbatches
    expect lifespan == 3 * d
}
