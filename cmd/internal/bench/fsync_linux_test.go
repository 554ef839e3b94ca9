//go:build linux

package bench

import (
	"os"
	"syscall"
)

// fdatasync flushes f's data (not its metadata), as a log append does.
func fdatasync(f *os.File) error { return syscall.Fdatasync(int(f.Fd())) }
