//go:build !linux

package e2e_test

import "os/exec"

// dieWithTest is a no-op where the kernel offers no parent-death signal:
// t.Cleanup still stops every process unless the test binary itself is
// killed.
func dieWithTest(*exec.Cmd) {}
