# expect: tests/errors/missing_passes.pp:8:29: error: on devices 0–3: device 0 never runs 1 pass that its stages need: BW7; add it to its order
schedule s {
    param d = 4
    param m = 8
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in 0..m - 1 { BW(j) }
    }
}
