# expect: tests/errors/lifespan_stage_out_of_range.pp:10:21: error: stage 4 out of range: S = 4, so lifespan[0..4]
schedule s {
    param d = 4
    param m = 8
    backward fused
    block period 3 {
        F at s
        BW at 3*d - 2 - 2*s
    }
    expect lifespan[d] <= 12
}
