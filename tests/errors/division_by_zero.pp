# expect: tests/errors/division_by_zero.pp:6:14: error: division by zero: '/' by a value that is 0
schedule s {
    param d = 4
    param m = 8
    let k = d - 4
    cost F = m / k
    backward fused
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
