//go:build !linux

package kubetest

import "os/exec"

// setParentDeathSignal does nothing here: only Linux has a parent death
// signal. A kube-apiserver whose test process died without its cleanup
// keeps running until it is killed.
func setParentDeathSignal(*exec.Cmd) {}
