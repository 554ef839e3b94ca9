// Command pivirtd-sim is a simulated backend for pivirt-agent: it plays
// pivirtd (VMs, networks) and iscsiman (volumes) as a real gRPC server
// with its state in bbolt, so that --dev, the local cluster and tests have
// backends to proxy to. It is a simulator, not a hypervisor.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		var ue *usageError
		if errors.As(err, &ue) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}
