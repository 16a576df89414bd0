# expect: tests/errors/param_d_after_place.pp:3:5: error: 'place' depends on the number of devices, but 'param d' comes later (at 5:5); move 'param d' above it
schedule s {
    place vshape
    param m = 8
    param d = 4
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in 0..m { BW(j) }
    }
}
