# expect: tests/errors/recompute_without_condition.pp:6:5: error: `recompute[s]` needs its condition: `recompute[s] = ...` (true for the stages s to recompute)
schedule s {
    param d = 2
    param m = 4
    backward fused
    recompute[s]
    block period 4 {
        F at s
        R at 4*d - 3 - 3*s
        BW at 4*d - 2 - 3*s
    }
}
