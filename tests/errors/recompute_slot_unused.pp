# expect: tests/errors/recompute_slot_unused.pp:10:36: error: this R applies to no stage marked `recompute`: mark its stages (`recompute[s] = ...`) or remove it
schedule s {
    param d = 2
    param m = 4
    place vshape
    backward fused
    recompute[s] = s < d
    block period 8 {
        chunk 0: F at 2*i, R at 7*d - 1 - i, BW at 7*d - i
        chunk 1: F at 3*d - 2 - i, R at 4*d - 2 + 2*i, BW at 4*d - 1 + 2*i
    }
}
