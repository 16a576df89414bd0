# expect: tests/errors/recompute_twice.pp:7:5: error: 'recompute' is given twice (also at 6:5); mark every stage in one line, e.g. `recompute[s] = s < 2 or s == S - 1`
schedule s {
    param d = 2
    param m = 4
    backward fused
    recompute[s] = s == 0
    recompute[s] = s == 1
    block period 4 {
        F at s
        R at 4*d - 3 - 3*s
        BW at 4*d - 2 - 3*s
    }
}
