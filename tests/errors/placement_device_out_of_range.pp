# expect: tests/errors/placement_device_out_of_range.pp:5:18: error: device 2 out of range: d = 2, so devices are 0..2
schedule s {
    param d = 2
    param m = 4
    place [0, 1, 2, 0]
    backward fused
    order { for c in chunks { for j in 0..m { F(j, c) } } }
}
