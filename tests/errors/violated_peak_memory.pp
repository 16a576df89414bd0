# expect: tests/errors/violated_peak_memory.pp:10:5: error: on devices 0–3: peak activation memory on device 0 is 8, above the bound 4 (`expect peak_memory <= d * M_B`); keep fewer microbatches in flight on that device (run its backward passes earlier) or raise the bound
schedule s {
    param d = 4
    param m = 8
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in 0..m { BW(j) }
    }
    expect peak_memory <= d * M_B
}
