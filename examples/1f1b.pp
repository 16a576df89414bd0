# 1F1B (PipeDream-flush): one forward, one fused backward, in turn.
# Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-2BW,
# ICML 2021, "PipeDream-Flush"); the building block is the one the zero-bubble
# paper draws for it (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
# F of stage s at s, its backward at 3d-2-2s, period T_F + T_BW.
# Works for every d >= 1 and m >= d (required below: fewer microbatches give a valid
# order with a smaller peak and larger bubble than the expectations state).
schedule one_f_one_b {
    param d = 4
    param m = 2 * d
    require m >= d, "1F1B's peak of d activations on device 0 needs m >= d microbatches (fewer: a valid order with a smaller peak)"
    place parallel
    backward fused
    block period 3 {
        F at s
        BW at 3*d - 2 - 2*s
    }
    # zero-bubble paper Table 1: peak p·M_B, bubble (p-1)(T_F + T_B + T_W) per device
    expect peak_memory <= d * M_B
    expect peak_memory[0] == d * M_B
    expect bubble == (d - 1) * (T_F + T_BW) / (m * (T_F + T_BW) + (d - 1) * (T_F + T_BW))
    expect makespan == (m + d - 1) * (T_F + T_BW)
    # controllable-memory paper: stage s lives 3(d - s), so holds d - s microbatches
    expect lifespan[0] == 3 * d
    expect lifespan[d - 1] == 3
}
