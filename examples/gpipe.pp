# GPipe: every forward, then every backward.
# Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
# Parallelism" (NeurIPS 2019), §2.2 and Figure 2(c); the order of
# torch.distributed.pipelining's ScheduleGPipe.
# Works for every d >= 1 and m >= 1.
schedule gpipe {
    param d = 4
    param m = 2 * d
    place parallel
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in 0..m { BW(j) }
    }
    # every device holds all m microbatches' activations before its first backward
    expect peak_memory == m * M_B
    # the same bubble as 1F1B: (p-1)(T_F + T_BW) per device
    expect bubble == (d - 1) * (T_F + T_BW) / (m * (T_F + T_BW) + (d - 1) * (T_F + T_BW))
}
