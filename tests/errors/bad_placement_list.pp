# expect: tests/errors/bad_placement_list.pp:5:5: error: device 2 holds no stage: the list must use every device 0..3 (d = 3)
schedule s {
    param d = 3
    param m = 4
    place [0, 1, 1, 0]
    backward fused
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
