# ZB-H2: no bubble at equal pass times, for (2p-1)·M_B of activations.
# Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), its handcrafted
# schedules, Figure 3 (bottom):
# worker s (from 0) runs 2d-2s-1 F before its first B, then F B W; its W trail its B
# by 2s microbatches, which fills the cool-down.
# Works for every d >= 1 and m >= 2d - 1 (required below: with fewer microbatches the
# order is still valid, but its peak is min(m, 2d - 1) and its bubble is not zero).
schedule zb_h2 {
    param d = 4
    param m = 2 * d
    require m >= 2*d - 1, "ZB-H2's zero bubble and 2d - 1 peak need m >= 2d - 1 microbatches"
    place parallel
    backward split
    block period 3 {
        F at s
        B at 6*d - 5*s - 5
        W at 6*d + s - 4
    }
    # the paper: worker i (from 1) holds (2p-2i+1)·M_B + (2i-2)·M_W; at most (2p-1)·M_B
    expect peak_memory <= (2*d - 1) * M_B
    expect peak_memory[0] == (2*d - 1) * M_B
    expect peak_memory[d - 1] == M_B + (2*d - 2) * M_W
    # Table 1: bubble (p-1)(T_F + T_B - 2T_W) per device: none at unit costs
    expect bubble == 0
    expect makespan == 3*m + d - 1
}
