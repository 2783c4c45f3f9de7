"""A detour calls C code, which the ABI lets assume DF = 0, and does not save DF:
a function that sets the direction flag is not jump-optimized (check
`direction_flag`, at the `std`)."""
from __future__ import annotations

from conftest import cc, kprewrite, write_spec

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
    std_at = int(subprocess_nm(prog)["back_copy"], 16) + 3 + 5 + 5     # mov, lea, lea
    assert f"direction_flag at {std_at:#x}" in line, line


def subprocess_nm(path):
    import subprocess
    out = {}
    for l in subprocess.run(["nm", str(path)], capture_output=True, text=True).stdout.splitlines():
        parts = l.split()
        if len(parts) == 3:
            out[parts[2]] = parts[0]
    return out


def test_probe_where_df_is_set_runs_as_a_breakpoint(tmp_path, runner):
    """A probe on the `rep movsb` itself (DF = 1 there) becomes an int3 probe: the
    handler runs with DF clear, and the copy goes on backwards."""
    from conftest import instrument, profile, run
    prog = cc(tmp_path, "prog", PROG, "-O2")
    assert run(prog).stdout == "ababcdef\n"
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "back_copy"\noffset = 14\n'
                      'pre_handler = "h"\n',
                      '#include <kprewrite/kprobes.h>\n'
                      'int h(struct kprobe *p, struct pt_regs *regs) { pr_info("df=%lu\\n", (regs->flags >> 10) & 1); return 0; }\n')
    line = kprewrite("check", prog, "--spec", spec).stdout.strip()
    assert "  int3  " in line, line
    r = run(instrument(prog, spec), runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == "ababcdef\n", r.stderr
    assert "df=1\n" in r.stderr and profile(r.stderr)["p_back_copy_14"] == (1, 0)
