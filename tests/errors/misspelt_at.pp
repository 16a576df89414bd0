# expect: tests/errors/misspelt_at.pp:6:11: error: unexpected name 'att' after 'F'; did you mean 'at'?
schedule s {
    param d = 4
    param m = 8
    block period 3 {
        F att s
    }
}
