# expect: tests/errors/recompute_pass_unmarked.pp:8:35: error: R is the recompute pass of a stage marked `recompute`, and this schedule marks none; add `recompute` (every stage) or `recompute[s] = ...` above
schedule s {
    param d = 2
    param m = 4
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in reversed(0..m) { R(j); BW(j) }
    }
}
