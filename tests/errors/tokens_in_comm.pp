# expect: tests/errors/tokens_in_comm.pp:6:17: error: 'comm' is one value for every microbatch; only the pass costs (F, B, W, BW, R) and the memory amounts (M_B, M_W, M_I) may follow a microbatch's 'tokens'
schedule s {
    param d = 2
    param m = 2
    backward fused
    cost comm = tokens / 1000
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
