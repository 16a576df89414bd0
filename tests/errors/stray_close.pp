# expect: tests/errors/stray_close.pp:4:21: error: ']' does not match '(' opened at 4:15
schedule s {
    param d = 4
    param m = (8 + 1]
}
