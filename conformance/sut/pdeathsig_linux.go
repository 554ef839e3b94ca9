package main

import (
	"os/exec"
	"syscall"
)

// setPdeathsig kills the child when the server under test dies: the suite
// may kill it without letting it stop its children.
func setPdeathsig(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
