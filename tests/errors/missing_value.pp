# expect: tests/errors/missing_value.pp:4:14: error: expected a value after '='
schedule s {
    param d = 4
    param m =
    order { F(0) }
}
