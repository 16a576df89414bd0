# expect: tests/errors/tokens_outside_cost.pp:4:15: error: undefined name 'tokens': a microbatch's length 'tokens' is bound only in `cost` and `memory` (declare `param tokens = N` to use its nominal value elsewhere)
schedule s {
    param d = 2
    param m = tokens / 512
    backward fused
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
