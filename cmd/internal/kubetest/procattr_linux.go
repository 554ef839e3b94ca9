package kubetest

import (
	"os/exec"
	"syscall"
)

// setParentDeathSignal has the kernel kill kube-apiserver when the test
// process dies without its cleanup (a test timeout's panic, a signal):
// otherwise it would outlive the test, retrying its etcd forever.
func setParentDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
