# expect: tests/errors/tokens_negative_cost.pp:6:15: error: a cost must be >= 0 for every length from 1 token; this one falls below 0 for long microbatches
schedule s {
    param d = 2
    param m = 2
    backward fused
    cost BW = 4 - tokens / 100
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
