// Command pitrust manages a PiTrust PKI on disk: the PiTrust Root CA, the X1
// Intermediate CA and the mTLS server and client certificates they issue
// (docs/pitrust.md), and runs the PiTrust CA server (pitrust
// serve) and its clients. The work is done by packages identity,
// identity/castore and cmd/internal/caserver; this is their command line.
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
