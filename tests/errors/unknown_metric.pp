# expect: tests/errors/unknown_metric.pp:7:12: error: unknown metric 'peak_mem'; did you mean 'peak_memory'?
schedule s {
    param d = 4
    param m = 8
    backward fused
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
    expect peak_mem <= 8
}
