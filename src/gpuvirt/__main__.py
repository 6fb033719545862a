from gpuvirt.cli.main import app

app()
