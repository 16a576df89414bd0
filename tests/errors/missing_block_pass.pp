# expect: tests/errors/missing_block_pass.pp:5:5: error: the block places no B for stage 0 (chunk 0 of device 0); add `B at ...`
schedule s {
    param d = 4
    param m = 8
    block period 3 {
        F at s
        W at 3*d - 1 + s
    }
}
