# ZB-V: zero bubble on a V-shape placement at 1F1B's activation memory.
# Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), §6: two chunks
# per device in a V (chunk 0 = stage i, chunk 1 = stage 2d-1-i), B split from W. The
# order is that of torch.distributed.pipelining's ScheduleZBVZeroBubble, which writes
# the paper's schedule as warm-up, steady F0 B0 W0 F1 B1 W1, and cool-down.
# Works for every d >= 1 and m >= 2d - 1 (torch pads fewer to 2d - 1 and drops the padding).
schedule zb_v {
    param d = 4
    param m = 2 * d
    require m >= 2*d - 1, "ZB-V's order needs m >= 2d - 1 microbatches"
    place vshape
    backward split
    memory M_W = M_B                  # activations count until W ends (the papers' V-shape unit)
    order {
        # warm-up: chunk-0 forwards, then chunk 1 joins; its first B/W follow at once
        for k in 0..2*(d - i) - 1 { F(k, 0) }
        for k in 0..i { F(k, 1); F(2*(d - i) - 1 + k, 0) }
        for k in 0..d - i { F(i + k, 1); B(k, 1); W(k, 1) }
        # steady state: one microbatch of each chunk per round
        for t in 0..m - d {
            if t < m - 2*d + i + 1 { F(2*d - i - 1 + t, 0) }
            B(t, 0); W(t, 0)
            F(d + t, 1); B(d - i + t, 1); W(d - i + t, 1)
        }
        # cool-down: the last input gradients first, the weight gradients after them
        for k in 0..i { B(m - d + k, 0); B(m - i + k, 1) }
        for k in 0..d - i { B(m - d + i + k, 0); W(m - d + k, 0) }
        for k in 0..i { W(m - i + k, 1) }
        for k in 0..i { W(m - i + k, 0) }
    }
    # §6: ZB-V keeps 1F1B's peak p·M_B, i.e. 2p chunks of M_B
    expect peak_memory <= 2 * d * M_B
    expect peak_memory[0] == 2 * d * M_B
    # §6: no bubble when T_F = T_B = T_W (checked at the default unit costs)
    expect bubble == 0
    expect makespan == 6*m + d - 1
}
