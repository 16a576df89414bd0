# expect: tests/errors/dualpipe_block.pp:6:5: error: a block runs every microbatch through all 4 stages, but 'dualpipe' runs 2 pipelines of 2 stages; write its order with 'order { ... }'
schedule s {
    param d = 2
    param m = 4
    place dualpipe
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W fill
    }
}
