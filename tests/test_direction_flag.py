"""A detour calls C code, which the ABI lets assume DF = 0, and does not save DF:
a function that sets the direction flag is not jump-optimized (check
`direction_flag`, at the `std`)."""
from __future__ import annotations

from conftest import cc, check_lines, instrument, kprewrite, profile, run, symbols, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86's direction flag (std/cld, rep movsb)

PROG = r"""
#include <stdio.h>
#include <string.h>
/* Copies backwards with DF set: a probe between std and cld must not run C with DF = 1. */
__asm__(
".text\n.globl back_copy\n.type back_copy,@function\nback_copy:\n"
"  mov %rdx,%rcx\n"
"  lea -1(%rdi,%rdx),%rdi\n"
"  lea -1(%rsi,%rdx),%rsi\n"
"  std\n"
"  rep movsb\n"
"  cld\n"
"  ret\n"
".size back_copy,.-back_copy\n");
void back_copy(char *d, const char *s, unsigned long n);
int main(void) {
    char buf[16] = "abcdefgh";
    back_copy(buf + 2, buf, 6);
    printf("%s\n", buf);
    return 0;
}
"""


def test_function_setting_df_is_not_optimized(tmp_path):
    prog = cc(tmp_path, "prog", PROG, "-O2")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "back_copy"\n')
    r = kprewrite("check", prog, "--spec", spec, check=False)
    line = r.stdout.strip()
    assert line.startswith("back_copy+0x0  k  ") and "  optimized" not in line, line
    std_at = symbols(prog)["back_copy"] + 3 + 5 + 5     # mov, lea, lea
    assert f"direction_flag at {std_at:#x}" in line, line


def _on_rep_movsb(tmp):
    prog = cc(tmp, "prog", PROG, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "back_copy"\noffset = 14\n'
                      'pre_handler = "h"\n',
                      '#include <kprewrite/kprobes.h>\n'
                      'int h(struct kprobe *p, struct pt_regs *regs) { pr_info("df=%lu\\n", (regs->flags >> 10) & 1); return 0; }\n')
    return prog, check_lines(prog, spec), instrument(prog, spec)


def test_probe_where_df_is_set_runs_as_a_breakpoint(once, runner):
    """A probe on the `rep movsb` itself (DF = 1 there) becomes an int3 probe: the
    handler runs with DF clear, and the copy goes on backwards."""
    prog, lines, out = once(_on_rep_movsb)
    assert run(prog).stdout == "ababcdef\n"
    line = "\n".join(lines).strip()
    assert "  int3  " in line, line
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == "ababcdef\n", r.stderr
    assert "df=1\n" in r.stderr and profile(r.stderr)["p_back_copy_14"] == (1, 0)
