# Looped breadth-first: every microbatch through a local stage before the next one.
# Lamy-Poirier, "Breadth-First Pipeline Parallelism" (MLSys 2023)
# (looped placement, breadth-first order); the order of torch.distributed.pipelining's
# ScheduleLoopedBFS (backward in reverse microbatch order).
# Works for every d >= 1, v >= 1 and m >= d (fewer microbatches: valid, larger bubble).
schedule looped_bfs {
    param d = 4
    param v = 2
    param m = 2 * d
    require m >= d, "the expected bubble holds for m >= d microbatches"
    place looped(v)
    backward fused
    order {
        for c in chunks { for j in 0..m { F(j, c) } }
        for c in reversed(chunks) { for j in reversed(0..m) { BW(j, c) } }
    }
    # a device holds every microbatch of every local stage at the turn
    expect peak_memory == v * m * M_B
    # with the costs of one chunk, the same bubble as interleaved 1F1B: (p-1)(T_F + T_BW)
    expect bubble == (d - 1) * (T_F + T_BW) / (m * v * (T_F + T_BW) + (d - 1) * (T_F + T_BW))
}
