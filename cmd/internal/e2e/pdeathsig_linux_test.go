package e2e_test

import (
	"os/exec"
	"syscall"
)

// dieWithTest makes the kernel SIGKILL the child when the test binary dies,
// so that no agent outlives a test binary killed by the -timeout alarm
// (which skips t.Cleanup). The signal is tied to the forking OS thread; the
// test never locks goroutines to threads, so such a thread never exits early.
func dieWithTest(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
