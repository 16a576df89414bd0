# expect: tests/errors/chunk_out_of_range.pp:9:50: error: chunk 2 out of range: device 0 holds 2 chunk(s), so 0..2
schedule s {
    param d = 4
    param m = 8
    param v = 2
    place looped(v)
    backward fused
    order {
        for c in 0..v + 1 { for j in 0..m { F(j, c) } }
    }
}
