/* kp_line.c: one line of text being built, cut at its end (the kernel's seq_buf). */
#ifndef KP_LINE_H
#define KP_LINE_H

struct kp_line { char *p, *end; };

void kp_line_puts(struct kp_line *l, const char *s);
void kp_line_putc(struct kp_line *l, char ch);
/* n bytes in one copy (a precomputed part of the line). */
void kp_line_put(struct kp_line *l, const char *s, unsigned long n);
void kp_line_hex(struct kp_line *l, unsigned long v, int width);
void kp_line_dec(struct kp_line *l, unsigned long v, int neg, int width, int left);
/* %pS: "sym+0xoff/0xsize" from the compiled symbol table (or the platform's kallsyms). */
void kp_line_sym(struct kp_line *l, unsigned long addr, int with_offset);

#endif
