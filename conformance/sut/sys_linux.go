package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
)

// setPdeathsig kills the child when the server under test dies: the suite
// may kill it without letting it stop its children.
func setPdeathsig(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// held keeps the port reservations' files open (and so locked) until the
// process exits.
var held []*os.File

// reserve takes port across the machine's processes, as the main module's
// internal/freeport does (the suite runs up to four servers under test at
// once, each picking ports): an exclusive, non-blocking lock on the port's
// file, held until this process exits. False when another running process
// holds it; true where the directory cannot be used.
func reserve(port int) bool {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("pivirt-freeport-%d", os.Getuid()))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return true
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return true
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		return false
	}
	held = append(held, f)
	return true
}
