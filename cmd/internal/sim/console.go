package sim

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

const (
	// maxLine bounds the shell's input line (a terminal's bell beyond).
	maxLine = 4096
	// maxTermSize bounds a terminal dimension the console accepts.
	maxTermSize = 10000
)

// Console is a running VM's serial console: a small shell behind a line
// discipline, as a guest's getty and shell would answer. Every request
// with input gets exactly one response (the echo, the command's output and
// the next prompt), the first after the banner's. The session ends when the
// shell exits (exit, Ctrl-D on an empty line: the last response says so,
// with the status), when the client closes its side, or when the VM stops
// or is deleted.
func (s *vmService) Console(stream grpc.BidiStreamingServer[vmv1.ConsoleRequest, vmv1.ConsoleResponse]) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	vm, err := s.vms.get(first.GetId())
	if err != nil {
		return err
	}
	if vm.GetPowerState() != running {
		return status.Errorf(codes.FailedPrecondition, "vm %q is %s: its console needs it running", vm.GetId(), vm.GetPowerState())
	}
	// Subscribed before the banner: a power-off from now on ends the
	// session.
	sub := s.watch.subscribe()
	defer s.watch.unsubscribe(sub)

	sh := &shell{name: vm.GetName(), cols: 80, rows: 24}
	banner := fmt.Sprintf("pivirtd-sim serial console of %s (%s)\r\nType help for the commands.\r\n\r\n%s", vm.GetName(), vm.GetId(), sh.prompt())
	if err := stream.Send(&vmv1.ConsoleResponse{Output: []byte(banner)}); err != nil {
		return err
	}

	ctx := stream.Context()
	msgs, errc := make(chan *vmv1.ConsoleRequest), make(chan error, 1)
	go func() {
		for {
			msg, err := stream.Recv()
			if err != nil {
				errc <- err
				return
			}
			select {
			case msgs <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	events := sub.ch
	for msg := first; ; {
		if msg != nil {
			if n := len(msg.GetInput()); n > maxConsoleInput {
				return invalid("input: %d bytes, at most %d per message", n, maxConsoleInput)
			}
			if sz := msg.GetSize(); sz != nil {
				if sz.GetCols() == 0 || sz.GetRows() == 0 || sz.GetCols() > maxTermSize || sz.GetRows() > maxTermSize {
					return invalid("size: %dx%d, want columns and rows of 1 to %d", sz.GetCols(), sz.GetRows(), maxTermSize)
				}
				sh.cols, sh.rows = sz.GetCols(), sz.GetRows()
			}
			if len(msg.GetInput()) > 0 {
				out, closed := sh.feed(msg.GetInput())
				if err := stream.Send(&vmv1.ConsoleResponse{Output: out, Closed: closed}); err != nil {
					return err
				}
				if closed != nil {
					return nil
				}
			}
		}
		msg = nil
		select {
		case msg = <-msgs:
		case err := <-errc:
			if err == io.EOF {
				return nil
			}
			return err
		case ev, ok := <-events:
			if !ok {
				events = nil // no more power tracking; the console goes on
				continue
			}
			if ev.obj.GetId() != vm.GetId() {
				continue
			}
			reason := ""
			switch {
			case ev.kind == eventDeleted:
				reason = "the VM was deleted"
			case ev.obj.GetPowerState() != running:
				reason = fmt.Sprintf("the VM is %s", ev.obj.GetPowerState())
			default:
				continue
			}
			return stream.Send(&vmv1.ConsoleResponse{
				Output: []byte("\r\n"),
				Closed: &vmv1.ConsoleClosed{Reason: reason},
			})
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// shell is the console's line discipline and shell.
type shell struct {
	name       string
	cols, rows uint32
	line       []byte
	status     int // of the last command, as $?
	// esc: 1 after ESC, 2 inside a control sequence (ESC [ or ESC O):
	// keys such as the arrows are dropped.
	esc    int
	lastCR bool
}

func (sh *shell) prompt() string { return "root@" + sh.name + ":~# " }

// feed takes what the user typed and returns what the terminal shows,
// and a reason when the shell exits.
func (sh *shell) feed(in []byte) ([]byte, *vmv1.ConsoleClosed) {
	var out []byte
	for _, b := range in {
		cr := sh.lastCR
		sh.lastCR = b == '\r'
		switch sh.esc {
		case 1:
			sh.esc = 0
			if b == '[' || b == 'O' {
				sh.esc = 2
			}
			continue
		case 2:
			if b >= 0x40 && b <= 0x7e {
				sh.esc = 0
			}
			continue
		}
		switch {
		case b == 0x1b:
			sh.esc = 1
		case b == '\n' && cr: // the LF of a CRLF
		case b == '\r' || b == '\n':
			out = append(out, "\r\n"...)
			res, closed := sh.run(string(sh.line))
			sh.line = sh.line[:0]
			out = append(out, res...)
			if closed != nil {
				return out, closed
			}
			out = append(out, sh.prompt()...)
		case b == 0x7f || b == 0x08: // erase one character
			if len(sh.line) > 0 {
				_, n := utf8.DecodeLastRune(sh.line)
				sh.line = sh.line[:len(sh.line)-n]
				out = append(out, "\b \b"...)
			}
		case b == 0x15: // Ctrl-U: erase the line
			for n := utf8.RuneCount(sh.line); n > 0; n-- {
				out = append(out, "\b \b"...)
			}
			sh.line = sh.line[:0]
		case b == 0x03: // Ctrl-C
			sh.line = sh.line[:0]
			sh.status = 130
			out = append(out, "^C\r\n"...)
			out = append(out, sh.prompt()...)
		case b == 0x04: // Ctrl-D
			if len(sh.line) == 0 {
				out = append(out, "logout\r\n"...)
				return out, &vmv1.ConsoleClosed{Reason: "the shell exited", ExitStatus: int32(sh.status)}
			}
		case b < 0x20: // other control characters: ignored
		case len(sh.line) >= maxLine:
			out = append(out, 0x07)
		default:
			sh.line = append(sh.line, b)
			out = append(out, b)
		}
	}
	return out, nil
}

// run runs one command line and returns its output (lines ending in CRLF).
func (sh *shell) run(line string) ([]byte, *vmv1.ConsoleClosed) {
	args := strings.Fields(line)
	if len(args) == 0 {
		return nil, nil
	}
	var b strings.Builder
	say := func(s string) { b.WriteString(s + "\r\n") }
	status := 0
	switch args[0] {
	case "help":
		say("Commands: echo ARGS, exit [N], hostname, help, ls, stty size, uname [-a], whoami.")
		say("Ctrl-C clears the line, Ctrl-D on an empty line logs out.")
	case "echo":
		words := args[1:]
		for i, w := range words {
			words[i] = strings.ReplaceAll(w, "$?", strconv.Itoa(sh.status))
		}
		say(strings.Join(words, " "))
	case "exit":
		code := sh.status
		if len(args) > 1 {
			n, err := strconv.Atoi(args[1])
			if err != nil || n < 0 || n > 255 {
				say("-sh: exit: Illegal number: " + args[1])
				sh.status = 2
				return []byte(b.String()), nil
			}
			code = n
		}
		say("logout")
		return []byte(b.String()), &vmv1.ConsoleClosed{Reason: "the shell exited", ExitStatus: int32(code)}
	case "hostname":
		say(sh.name)
	case "ls":
	case "stty":
		if len(args) == 2 && args[1] == "size" {
			say(fmt.Sprintf("%d %d", sh.rows, sh.cols))
		} else {
			say("stty: only 'stty size' is known here")
			status = 1
		}
	case "uname":
		if len(args) > 1 && args[1] == "-a" {
			say("Linux " + sh.name + " 6.1.0-pivirt-sim #1 SMP x86_64 GNU/Linux")
		} else {
			say("Linux")
		}
	case "whoami":
		say("root")
	default:
		say("-sh: " + args[0] + ": command not found")
		status = 127
	}
	sh.status = status
	return []byte(b.String()), nil
}
