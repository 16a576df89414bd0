# expect: tests/errors/recompute_on_unmarked_stage.pp:9:35: error: device 1 runs R0-R3:s1 (4 passes): a recompute pass R on stage 1, which keeps its activations; mark it (`recompute[s] = ...`) or remove the R
schedule s {
    param d = 2
    param m = 4
    backward fused
    recompute[s] = s == 0
    order {
        for j in 0..m { F(j) }
        for j in reversed(0..m) { R(j); BW(j) }
    }
}
