# expect: tests/errors/group_not_dividing_m.pp:8:34: error: the group size 4 does not divide m = 10: every group holds 4 microbatches; make m a multiple of 4 or pick a divisor of m
schedule s {
    param d = 4
    param v = 2
    param m = 10
    place looped(v)
    backward fused
    block period 3 * v * d group d every 3 {
        F at i + 3 * d * c
        BW at i + 1 + 3 * (2 * (d - 1 - i) + (v - 1) * d) + 3 * d * (v - 1 - c)
    }
}
