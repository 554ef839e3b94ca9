// Command pivirt-agent is the PiVirt node agent.
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
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT)
	defer stop()
	globalLogs = routeLibraryLogs
	err := Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		var ue *UsageError
		if errors.As(err, &ue) {
			fmt.Fprintf(os.Stderr, "Run '%s --help' for usage.\n", ue.Command)
			os.Exit(2)
		}
		os.Exit(1)
	}
}
