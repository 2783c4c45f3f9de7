"""Linux kernel images: vmlinux (with or without .symtab) and bzImage."""
