# expect: tests/errors/tokens_not_quadratic.pp:6:14: error: a value in tokens is a + b*tokens + c*tokens^2, and this one is not: at tokens = 1000 it is 1000, where the quadratic through tokens = 0, 1, 2 gives 512
schedule s {
    param d = 2
    param m = 2
    backward fused
    cost F = max(tokens, 512)
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
