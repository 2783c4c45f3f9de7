/*
 * kprobe_profile on request.  KPREWRITE_PROFILE_SIGNAL=USR1 (or USR2, or a
 * signal number) installs a handler that writes the kprobe_profile table
 * where KPREWRITE_PROFILE says (standard error if unset) each time the signal
 * arrives, like reading tracing/kprobe_profile while the program runs.
 * Opt-in, because it takes the signal from the program.
 */
#include "kp_signal.h"

static void kp_profile_on_signal(int sig)
{
	(void)sig;
	kp_write_profile();	/* raw write(2)s only: async-signal-safe */
}

void kp_profile_signal_configure(const char *value)
{
	int sig = 0;
	if (!value || !*value)
		return;
	if (!strcmp(value, "USR1") || !strcmp(value, "SIGUSR1"))
		sig = 10;
	else if (!strcmp(value, "USR2") || !strcmp(value, "SIGUSR2"))
		sig = 12;
	else
		for (const char *p = value; *p >= '0' && *p <= '9'; p++)
			sig = sig * 10 + (*p - '0');
	if (sig <= 0 || sig >= 65 || sig == 9 || sig == 19)
		return;
	if (!kp_rt.profile_path)
		kp_rt.profile_path = "-";
	struct kp_ksigaction sa = { (void *)kp_profile_on_signal, KP_SA_RESTORER | KP_SA_RESTART, kp_arch_sigreturn, 0 };
	kp_syscall6(__NR_rt_sigaction, sig, (long)&sa, 0, 8, 0, 0);
}
