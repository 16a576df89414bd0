# expect: tests/errors/group_collision.pp:10:9: error: on device 0, BW of stage 0 for microbatch 0 [11, 13) collides with F of stage 0 for microbatch 0 [0, 1) modulo the period 12 (at 11 and 0 mod 12, overlapping 1); move one of them or raise the period (and 4 more like it)
schedule s {
    param d = 2
    param m = 4
    place looped(2)
    backward fused
    # groups of 2, 2 apart: too close for a forward and a two-unit backward
    block period 12 group 2 every 2 {
        F at i + 4 * c
        BW at i + 1 + 4 * (1 - c) + 6 * (1 - i)
    }
}
