# expect: tests/errors/two_statements_one_line.pp:3:17: error: 'param' starts a new statement: put it on its own line or after ';'
schedule s {
    param d = 4 param m = 8
}
