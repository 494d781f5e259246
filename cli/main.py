def main() -> None:
    print("leyline")
