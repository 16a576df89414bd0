# expect: tests/errors/missing_value_after_operator.pp:4:18: error: expected a value after '*'
schedule s {
    param d = 4
    param m = 2 *
}
