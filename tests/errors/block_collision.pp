# expect: tests/errors/block_collision.pp:7:9: error: on devices 0, 2 (device 0 shown), B of stage 0 [10, 11) collides with F of stage 0 [0, 1) modulo the period 2 (at 0 and 0 mod 2, overlapping 1); move one of them or raise the period
schedule s {
    param d = 4
    param m = 8
    block period 2 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d - 1 + s
    }
}
