# expect: tests/errors/violated_lifespan.pp:11:5: error: stage 0's lifespan is 12, above the bound 9 (`expect lifespan[0] <= 3 * (d - 1)`); start its backward earlier (or its F later) in the block, or raise the bound
schedule s {
    param d = 4
    param m = 8
    backward fused
    block period 3 {
        F at s
        BW at 3*d - 2 - 2*s
    }
    expect peak_memory <= d * M_B
    expect lifespan[0] <= 3 * (d - 1)
}
