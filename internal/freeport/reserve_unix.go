//go:build unix

package freeport

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// held keeps the reservations' files open (and so locked) for the life of
// the process; the kernel drops the locks when it exits, however it exits.
var held []*os.File

// reserve takes port for this process across the machine: an exclusive,
// non-blocking lock on the port's file. False when another running process
// holds it. Where the directory cannot be used, ports are not reserved
// across processes (the free-port check alone remains).
func reserve(port int) bool {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("pivirt-freeport-%d", os.Getuid()))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return true
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return true
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		_ = f.Close()
		return false
	}
	held = append(held, f)
	return true
}
