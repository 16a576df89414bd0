# expect: tests/errors/missing_with.pp:7:29: error: unexpected '{'; expected 'with'
schedule s {
    param d = 4
    param m = 8
    backward fused
    order {
        interleave { F(0) } { BW(0) }
    }
}
