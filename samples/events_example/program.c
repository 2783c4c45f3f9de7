/*
 * A sample for kprobe_events lines: a toy "open" path with the kernel's names.
 * Build: gcc -O2 -o program program.c
 */
#include <stdio.h>
#include <string.h>

struct file {
	int fd;
	const char *path;
	unsigned int flags;
};

struct file files[8];
int nr_files;

__attribute__((noinline)) void fd_install(unsigned int fd, struct file *f)
{
	__asm__ volatile("" ::: "memory");
	files[fd] = *f;
	nr_files++;
}

__attribute__((noinline)) long do_sys_open(int dfd, const char *filename, int flags, unsigned short mode)
{
	__asm__ volatile("" ::: "memory");
	if (!strncmp(filename, "/missing", 8) || nr_files == 8)
		return -2;	/* -ENOENT */
	struct file f = { nr_files, filename, (unsigned int)flags | mode };
	fd_install(f.fd, &f);
	return f.fd;
}

int main(void)
{
	const char *names[] = { "/etc/hostname", "/missing/file", "/tmp/out.txt" };
	for (int i = 0; i < 3; i++)
		printf("open(%s) = %ld\n", names[i], do_sys_open(-100, names[i], 0x8000 | i, 0644));
	for (int i = 0; i < nr_files; i++)
		printf("fd %d: %s\n", files[i].fd, files[i].path);
	return 0;
}
