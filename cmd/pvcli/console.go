package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// escapeByte detaches from a console: Ctrl-], as telnet and virsh console.
const escapeByte = 0x1d

// consoleChunk is the most input sent in one message.
const consoleChunk = 32 << 10

func (a *app) newVMConsoleCmd() *cobra.Command {
	var noTTY bool
	cmd := &cobra.Command{
		Use:   "console ID",
		Short: "Attach the terminal to a running VM's serial console (Ctrl-] detaches)",
		Long: `Attach the terminal to a running VM's serial console, through any node.

On a terminal, the terminal is put in raw mode: every key goes to the VM
(Ctrl-C too), its window size is passed on and again whenever it changes,
and Ctrl-] detaches, leaving the VM's session as it is. When the console
closes on the VM's side (the shell exits, the VM is powered off) pvcli says
why and exits with the shell's exit status.

With --no-tty, or when stdin is not a terminal, stdin and stdout are piped
as they are (for scripts): the end of stdin closes the input side, and
pvcli returns when the VM's side ends.

The caller needs the console verb on virtualmachines (a vm-owner, on its
own VMs).`,
		Args: positional("ID"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			return a.backendCall(cmd, true, func(ctx context.Context, c *clientConn) error {
				return a.console(ctx, c, args[0], noTTY)
			})
		}),
	}
	cmd.Flags().BoolVar(&noTTY, "no-tty", false, "pipe stdin and stdout as they are, even on a terminal: no raw mode, no window size, no escape key")
	return cmd
}

// exitStatus is the exit status of the program that ended a console
// session: pvcli exits with it, printing nothing more.
type exitStatus int

func (e exitStatus) Error() string {
	return fmt.Sprintf("the console's shell exited with status %d", int(e))
}

// console runs a console session of VM id.
func (a *app) console(ctx context.Context, c *clientConn, id string, noTTY bool) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	in, _ := a.stdin.(*os.File)
	tty := !noTTY && in != nil && term.IsTerminal(int(in.Fd()))

	stream := c.vm.Console(ctx)
	var sendMu sync.Mutex
	send := func(req *vmv1.ConsoleRequest) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return stream.Send(req)
	}
	// Cancelled (detached, interrupted): the request's end too, as the
	// HTTP/2 transport notices a cancellation only between reads of the
	// request's body, which waits for the next key.
	stopClose := context.AfterFunc(ctx, func() {
		sendMu.Lock()
		defer sendMu.Unlock()
		_ = stream.CloseRequest()
	})
	defer stopClose()
	first := &vmv1.ConsoleRequest{Id: id}
	if tty {
		first.Size = termSize(in)
	}
	if err := send(first); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	// The banner, or why there is no console (stopped, not allowed),
	// before the terminal changes.
	resp, err := stream.Receive()
	if err != nil {
		_ = stream.CloseRequest()
		return err
	}
	a.warnUnavailable(stream.ResponseHeader())

	if tty {
		fmt.Fprintf(a.stderr, "Connected to the console of %s. Ctrl-] detaches.\n", id)
		state, err := term.MakeRaw(int(in.Fd()))
		if err != nil {
			return fmt.Errorf("put the terminal in raw mode: %w (use --no-tty to pipe stdin as it is)", err)
		}
		defer func() { _ = term.Restore(int(in.Fd()), state) }()
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case <-winch:
					if sz := termSize(in); sz != nil {
						_ = send(&vmv1.ConsoleRequest{Size: sz})
					}
				}
			}
		}()
	}

	detached := make(chan struct{})
	go func() {
		buf := make([]byte, consoleChunk)
		for {
			n, err := a.stdin.Read(buf)
			chunk := buf[:n]
			if tty {
				if i := bytes.IndexByte(chunk, escapeByte); i >= 0 {
					if i > 0 {
						_ = send(&vmv1.ConsoleRequest{Input: bytes.Clone(chunk[:i])})
					}
					close(detached)
					cancel()
					return
				}
			}
			if n > 0 {
				if send(&vmv1.ConsoleRequest{Input: bytes.Clone(chunk)}) != nil {
					return // the stream ended: its receive side says why
				}
			}
			if err != nil {
				sendMu.Lock()
				_ = stream.CloseRequest()
				sendMu.Unlock()
				return
			}
		}
	}()

	out := a.stdout
	var closed *vmv1.ConsoleClosed
	for {
		if _, err := out.Write(resp.GetOutput()); err != nil {
			return err
		}
		if resp.GetClosed() != nil {
			closed = resp.GetClosed()
		}
		if resp, err = stream.Receive(); err != nil {
			break
		}
	}
	_ = stream.CloseResponse()
	select {
	case <-detached:
		if tty {
			fmt.Fprint(a.stderr, "\r\n")
		}
		fmt.Fprintf(a.stderr, "Detached from the console of %s.\n", id)
		return nil
	default:
	}
	if !errors.Is(err, io.EOF) {
		if watchErr(ctx, err) == nil {
			return nil // interrupted (without a terminal, Ctrl-C is a signal), or --timeout
		}
		if tty {
			fmt.Fprint(a.stderr, "\r\n")
		}
		return err
	}
	if closed == nil {
		return nil
	}
	if tty {
		fmt.Fprint(a.stderr, "\r\n")
		fmt.Fprintf(a.stderr, "The console of %s closed: %s (exit status %d).\n", id, closed.GetReason(), closed.GetExitStatus())
	}
	if closed.GetExitStatus() != 0 {
		return exitStatus(closed.GetExitStatus())
	}
	return nil
}

// termSize is the terminal's window, or nil when it cannot be read.
func termSize(f *os.File) *vmv1.ConsoleSize {
	cols, rows, err := term.GetSize(int(f.Fd()))
	if err != nil || cols <= 0 || rows <= 0 {
		return nil
	}
	return &vmv1.ConsoleSize{Cols: uint32(cols), Rows: uint32(rows)}
}
