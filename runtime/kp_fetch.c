/*
 * The fetch engine: runs the fetch programs kprewrite compiled from FETCHARGS
 * (process_fetch_insn() of kernel/trace/trace_kprobe.c and
 * trace_probe_tmpl.h) and prints each value with its type's print function.
 *
 * Memory is read through the platform's fault-reporting copies
 * (kp_platform_copy_nofault(), the kernel's copy_from_kernel_nofault(), and
 * kp_platform_copy_user_nofault(), its copy_from_user_nofault(), for `ustring`
 * and the `+u` dereferences): a bad pointer prints "(fault)" and never crashes
 * the probed program.
 */
#include "kp_trace.h"

#define KP_STRING_MAX 256	/* bytes of a string argument (the kernel: MAX_STRING_SIZE) */

/* --- the record (kp_trace.h) ---------------------------------------------------------------- */

static int kp_rec_room(struct kp_rec *r, unsigned long n)
{
	if (r->full || (unsigned long)(r->end - r->p) < n) {
		r->full = 1;
		return 0;
	}
	return 1;
}

static void kp_rec_tag(struct kp_rec *r, unsigned char tag)
{
	if (kp_rec_room(r, 1))
		*r->p++ = tag;
}

static void kp_rec_val(struct kp_rec *r, unsigned long v, unsigned int size)
{
	if (kp_rec_room(r, 1 + size)) {
		*r->p++ = KP_REC_VAL;
		memcpy(r->p, &v, size);		/* little-endian: the low bytes */
		r->p += size;
	}
}

/* A string argument, copied into the record as the kernel's fetch_store_string() copies it
 * (at most KP_STRING_MAX bytes, up to its NUL), or KP_REC_FAULT. */
static void kp_rec_string(struct kp_rec *r, unsigned long addr, int tid, int user)
{
	if (!kp_rec_room(r, 3))
		return;
	unsigned long room = r->end - r->p - 3, max = room < KP_STRING_MAX ? room : KP_STRING_MAX;
	unsigned char *buf = r->p + 3;
	unsigned long n = 0;
	int done = 0;
	while (!done && n < max) {
		unsigned long chunk = 4096 - ((addr + n) & 4095);	/* never across a page we did not ask for */
		if (chunk > max - n)
			chunk = max - n;
		if (user ? kp_platform_copy_user_nofault(buf + n, addr + n, chunk, tid)
			 : kp_platform_copy_nofault(buf + n, addr + n, chunk, tid)) {
			*r->p++ = KP_REC_FAULT;
			return;
		}
		for (unsigned long i = n; i < n + chunk; i++)
			if (!buf[i]) {
				done = 1;
				chunk = i - n;
				break;
			}
		n += chunk;
	}
	if (!done && max < KP_STRING_MAX) {	/* the record would cut it short */
		r->full = 1;
		return;
	}
	r->p[0] = KP_REC_STR;
	r->p[1] = (unsigned char)n;
	r->p[2] = (unsigned char)(n >> 8);
	r->p += 3 + n;
}

/* A string argument's text: "text", control characters escaped, so a line stays one line. */
static void kp_print_string(struct kp_line *l, const unsigned char *s, unsigned long n)
{
	kp_line_putc(l, '"');
	for (unsigned long i = 0; i < n; i++) {
		unsigned char ch = s[i];
		if (ch == '\\' || ch == '"') {
			kp_line_putc(l, '\\');
			kp_line_putc(l, ch);
		} else if (ch < 0x20 || ch == 0x7f) {
			kp_line_puts(l, ch == '\n' ? "\\n" : ch == '\t' ? "\\t" : "\\x");
			if (ch != '\n' && ch != '\t')
				kp_line_hex(l, ch, 2);
		} else {
			kp_line_putc(l, ch);
		}
	}
	kp_line_putc(l, '"');
}

static void kp_print_value(struct kp_line *l, const struct kp_probe_arg *a, unsigned long v)
{
	unsigned int bits = a->size * 8;
	unsigned long mask = bits >= 64 ? ~0UL : (1UL << bits) - 1;
	switch (a->print) {
	case KP_PRINT_U:
		kp_line_dec(l, v & mask, 0, 0, 0);
		break;
	case KP_PRINT_S: {
		long s = bits >= 64 ? (long)v : (long)(v << (64 - bits)) >> (64 - bits);
		kp_line_dec(l, s < 0 ? -(unsigned long)s : (unsigned long)s, s < 0, 0, 0);
		break;
	}
	case KP_PRINT_X:
		kp_line_puts(l, "0x");
		kp_line_hex(l, v & mask, 0);
		break;
	case KP_PRINT_CHAR:
		kp_line_putc(l, '\'');
		kp_line_putc(l, (char)v);
		kp_line_putc(l, '\'');
		break;
	case KP_PRINT_SYMBOL:
		kp_line_sym(l, v, 1);
		break;
	case KP_PRINT_SYMSTR:
		kp_line_putc(l, '"');
		kp_line_sym(l, v, 1);
		kp_line_putc(l, '"');
		break;
	}
}

static unsigned long kp_stack_nth(struct kp_fetch_ctx *c, unsigned long n, int *fault)
{
	unsigned long v = 0;
	*fault = kp_platform_copy_nofault(&v, kernel_stack_pointer(c->regs) + 8 * n, 8, c->tid) != 0;
	return v;
}

/* A value's bytes in the record: the type's (1, 2, 4 or 8). */
static unsigned int kp_val_size(const struct kp_probe_arg *a)
{
	return a->size && a->size < 8 ? a->size : 8;
}

/* One argument into the record: stage 1 (a value), stage 2 (dereferences), stage 3 (store,
 * bitfield, array), as process_fetch_insn() runs them at the hit. */
void kp_fetch_arg(struct kp_rec *r, const struct kp_probe_arg *a, struct kp_fetch_ctx *c)
{
	const struct kp_fetch_insn *code = a->code, *st;
	struct pt_regs *regs = c->regs;
	unsigned long val = 0, lval = 0;
	int fault = 0;

	switch (code->op) {
	case KP_FETCH_REG:
		val = *(unsigned long *)((char *)regs + code->param);
		break;
	case KP_FETCH_STACK:
		val = kp_stack_nth(c, code->param, &fault);
		break;
	case KP_FETCH_STACKP:
		val = kernel_stack_pointer(regs);
		break;
	case KP_FETCH_RETVAL:
		val = regs_return_value(regs);
		break;
	case KP_FETCH_COMM:
		val = (unsigned long)kp_fetch_comm(c);
		break;
	case KP_FETCH_ARG:
		/* regs_get_kernel_argument(): the stack part at a function entry. */
		if (code->param < KP_ARCH_REG_ARGS)
			val = regs_get_kernel_argument(regs, code->param);
		else
			val = kp_stack_nth(c, kp_arch_stack_arg(code->param), &fault);
		break;
	case KP_FETCH_IMM:
		val = code->imm;
		break;
	case KP_FETCH_IMM_LINK:
		val = code->imm + kp_rt.bias;
		break;
	case KP_FETCH_DATA:
		val = (unsigned long)code->data;
		break;
	default:
		fault = 1;
	}
	if (fault)
		goto fault;
	code++;
	while (code->op == KP_FETCH_DEREF || code->op == KP_FETCH_UDEREF) {
		lval = val;
		if (code->op == KP_FETCH_UDEREF ? kp_platform_copy_user_nofault(&val, val + code->imm, 8, c->tid)
						: kp_platform_copy_nofault(&val, val + code->imm, 8, c->tid))
			goto fault;
		code++;
	}
	st = code;
	for (unsigned int i = 0;;) {
		const struct kp_fetch_insn *op = st;
		unsigned long v = 0;
		fault = 0;
		switch (op->op) {
		case KP_FETCH_ST_RAW:
			v = val;
			break;
		case KP_FETCH_ST_MEM:
			fault = kp_platform_copy_nofault(&v, val + op->imm, op->size, c->tid) != 0;
			break;
		case KP_FETCH_ST_UMEM:
			fault = kp_platform_copy_user_nofault(&v, val + op->imm, op->size, c->tid) != 0;
			break;
		case KP_FETCH_ST_STRING:
		case KP_FETCH_ST_USTRING: {
			int user = op->op == KP_FETCH_ST_USTRING;
			/* an array of strings: the next pointer read as the kernel's
			 * probe_mem_read() reads it, ustring or not */
			if (i && kp_platform_copy_nofault(&val, lval + 8 * i + st[-1].imm, 8, c->tid))
				kp_rec_tag(r, KP_REC_FAULT);
			else
				kp_rec_string(r, val + op->imm, c->tid, user);
			goto next;
		}
		}
		op++;
		if (op->op == KP_FETCH_MOD_BF) {
			unsigned int bits = op->size * 8;
			v <<= 64 - bits + op->lshift;
			v >>= 64 - bits + op->rshift;
		}
		if (fault)
			kp_rec_tag(r, KP_REC_FAULT);
		else
			kp_rec_val(r, v, kp_val_size(a));
next:
		if (++i >= a->count || r->full)
			break;
		if (op->op != KP_FETCH_ST_STRING && op->op != KP_FETCH_ST_USTRING)
			val += a->size;
	}
	return;
fault:
	kp_rec_tag(r, KP_REC_ARG_FAULT);
}

/* One argument's text from the record, as print_probe_args() prints it from the ring
 * buffer's entry: the value, "(fault)", a string, or {a,b,...} for an array. */
int kp_print_arg(struct kp_line *l, const struct kp_probe_arg *a, const unsigned char **pp, const unsigned char *end)
{
	const unsigned char *p = *pp;
	if (p >= end)
		return 0;
	if (*p == KP_REC_ARG_FAULT) {
		kp_line_puts(l, "(fault)");
		*pp = p + 1;
		return 1;
	}
	unsigned int n = a->count ? a->count : 1, size = kp_val_size(a);
	if (a->count)
		kp_line_putc(l, '{');
	for (unsigned int i = 0; i < n; i++) {
		if (i)
			kp_line_putc(l, ',');
		if (p >= end)
			return 0;
		switch (*p++) {
		case KP_REC_VAL: {
			unsigned long v = 0;
			if ((unsigned long)(end - p) < size)
				return 0;
			memcpy(&v, p, size);
			p += size;
			kp_print_value(l, a, v);
			break;
		}
		case KP_REC_FAULT:
			kp_line_puts(l, "(fault)");
			break;
		case KP_REC_STR: {
			if (end - p < 2)
				return 0;
			unsigned long len = p[0] | (unsigned long)p[1] << 8;
			p += 2;
			if ((unsigned long)(end - p) < len)
				return 0;
			kp_print_string(l, p, len);
			p += len;
			break;
		}
		default:
			return 0;
		}
	}
	if (a->count)
		kp_line_putc(l, '}');
	*pp = p;
	return 1;
}
