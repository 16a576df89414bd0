# expect: tests/errors/unclosed_brace.pp:5:20: error: '{' opened at 5:20 is never closed
schedule s {
    param d = 4
    param m = 8
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d - 1 + s
    expect makespan == 3*m + d - 1
}
